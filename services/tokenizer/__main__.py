from services.tokenizer.config import TokenizerConfig
from services.tokenizer.service import TokenizerService
from shared.service import service_main

service_main(TokenizerService, [TokenizerConfig])
