"""disttrain.train: the models, datasets and training loop every strategy shares.

    from disttrain.train import TrainConfig, train
    result = train(TrainConfig(model="lenet", dataset="digits", epochs=2))
    print(result.accuracy)
"""

from disttrain.train.config import ParallelOptions, TrainConfig
from disttrain.train.data import DATASETS, DataInfo, DataOptions, DatasetSplits, build_dataset
from disttrain.train.loop import train
from disttrain.train.metrics import StepRecord
from disttrain.train.models import MODELS, build_model
from disttrain.train.result import EvalPoint, TrainResult
from disttrain.train.sampler import DistributedSampler
from disttrain.train.strategies import STRATEGIES, BuildContext, Strategy, StrategySpec

__all__ = [
    "DATASETS",
    "MODELS",
    "STRATEGIES",
    "BuildContext",
    "DataInfo",
    "DataOptions",
    "DatasetSplits",
    "DistributedSampler",
    "EvalPoint",
    "ParallelOptions",
    "StepRecord",
    "Strategy",
    "StrategySpec",
    "TrainConfig",
    "TrainResult",
    "build_dataset",
    "build_model",
    "train",
]
