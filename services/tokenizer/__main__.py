from services.tokenizer.service import TokenizerConfig, TokenizerService
from shared.service import service_main

service_main(TokenizerService, [TokenizerConfig])
