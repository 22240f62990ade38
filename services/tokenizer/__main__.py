from specmesh.services.tokenizer.config import TokenizerConfig
from specmesh.services.tokenizer.service import TokenizerService
from specmesh.shared.service import service_main

service_main(TokenizerService, [TokenizerConfig])
