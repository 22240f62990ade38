from services.prefill.config import PrefillConfig
from services.prefill.service import PrefillService
from shared.engine.engine import EngineConfig
from shared.service import service_main
from shared.speculative.config import SpeculativeConfig
from shared.transport import TransportConfig

service_main(PrefillService, [EngineConfig, SpeculativeConfig, TransportConfig, PrefillConfig])
