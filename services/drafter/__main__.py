from services.drafter.service import DrafterConfig, DrafterService
from shared.service import service_main
from shared.speculative.config import SpeculativeConfig

service_main(DrafterService, [DrafterConfig, SpeculativeConfig])
