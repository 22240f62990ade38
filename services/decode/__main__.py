from specmesh.services.decode.config import DecodeConfig
from specmesh.services.decode.service import DecodeService
from specmesh.shared.engine.engine import EngineConfig
from specmesh.shared.service import service_main
from specmesh.shared.speculative.config import SpeculativeConfig
from specmesh.shared.transport import TransportConfig

service_main(DecodeService, [EngineConfig, SpeculativeConfig, TransportConfig, DecodeConfig])
