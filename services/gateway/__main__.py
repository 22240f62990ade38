from services.gateway.config import GatewayConfig
from services.gateway.service import GatewayService
from shared.service import service_main

service_main(GatewayService, [GatewayConfig])
