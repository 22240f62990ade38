from specmesh.services.drafter.config import DrafterConfig
from specmesh.services.drafter.service import DrafterService
from specmesh.shared.service import service_main
from specmesh.shared.speculative.config import SpeculativeConfig
from specmesh.shared.transport import TransportConfig

service_main(DrafterService, [DrafterConfig, SpeculativeConfig, TransportConfig])
