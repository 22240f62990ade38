"""One kernel's outcome against its reference, and the table `python -m specmesh.kernels.check`
prints."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Result:
    kernel: str
    shape: str
    error: float | None  # max abs error against the reference; None: held to exact equality
    tolerance: float | None
    passed: bool

    @classmethod
    def close(
        cls, kernel: str, shape: str, out: torch.Tensor, ref: torch.Tensor, tol: float
    ) -> Result:
        error = (out.float() - ref.float()).abs().max().item()
        return cls(kernel, shape, error, tol, error <= tol)

    @classmethod
    def exact(cls, kernel: str, shape: str, passed: bool) -> Result:
        return cls(kernel, shape, None, None, passed)

    def outcome(self) -> str:
        if self.error is None:
            return "exact match" if self.passed else "differs"
        return f"{self.error:.1e} (tol {self.tolerance:.0e})"


def table(results: list[Result]) -> str:
    rows = [("kernel", "shape", "max abs error / exact", "pass")]
    rows += [(r.kernel, r.shape, r.outcome(), "ok" if r.passed else "FAIL") for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = ("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in rows)
    return "\n".join(line.rstrip() for line in lines)
