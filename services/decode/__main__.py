from services.decode.config import DecodeConfig
from services.decode.service import DecodeService
from shared.engine.engine import EngineConfig
from shared.service import service_main
from shared.speculative.config import SpeculativeConfig
from shared.transport import TransportConfig

service_main(DecodeService, [EngineConfig, SpeculativeConfig, TransportConfig, DecodeConfig])
