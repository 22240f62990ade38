"""The drafters trained here for specmesh's default model, SmolLM2-135M-Instruct: one folder
per algorithm (`SmolLM2-135M-Instruct-EAGLE3`, `-NEXTN`, `-DFLASH`, `-STANDALONE`), each with
its weights, config and the command that made it (README.md, training.json).

Data only: `specmesh.shared.speculative.config` finds them here. The repository's folder
drafters/ is this package, installed by its own distribution, `specmesh-drafters`, so that
the main `specmesh` wheel stays small; a checkout finds it without installing
(specmesh/__init__.py).
"""
