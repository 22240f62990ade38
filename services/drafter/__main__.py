from services.drafter.config import DrafterConfig
from services.drafter.service import DrafterService
from shared.service import service_main
from shared.speculative.config import SpeculativeConfig
from shared.transport import TransportConfig

service_main(DrafterService, [DrafterConfig, SpeculativeConfig, TransportConfig])
