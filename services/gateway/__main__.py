from specmesh.services.gateway.config import GatewayConfig
from specmesh.services.gateway.service import GatewayService
from specmesh.shared.service import service_main

service_main(GatewayService, [GatewayConfig])
