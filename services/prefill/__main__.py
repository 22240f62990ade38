from specmesh.services.prefill.config import PrefillConfig
from specmesh.services.prefill.service import PrefillService
from specmesh.shared.engine.engine import EngineConfig
from specmesh.shared.service import service_main
from specmesh.shared.speculative.config import SpeculativeConfig
from specmesh.shared.transport import TransportConfig

service_main(PrefillService, [EngineConfig, SpeculativeConfig, TransportConfig, PrefillConfig])
