from services.gateway.service import GatewayConfig, GatewayService
from shared.service import service_main

service_main(GatewayService, [GatewayConfig])
