from specmesh.services.learner.config import LearnerConfig, OnlineLearningConfig
from specmesh.services.learner.service import LearnerService
from specmesh.shared.service import service_main
from specmesh.shared.speculative.config import SpeculativeConfig
from specmesh.shared.transport import TransportConfig

service_main(
    LearnerService, [LearnerConfig, OnlineLearningConfig, SpeculativeConfig, TransportConfig]
)
