from services.learner.config import LearnerConfig, OnlineLearningConfig
from services.learner.service import LearnerService
from shared.service import service_main
from shared.speculative.config import SpeculativeConfig
from shared.transport import TransportConfig

service_main(
    LearnerService, [LearnerConfig, OnlineLearningConfig, SpeculativeConfig, TransportConfig]
)
