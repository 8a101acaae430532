"""Recipe of the embedded default model: Python sources, byte-level BPE, joint MTP loss."""

from jaxspec.training.trainer import MODEL_PRESETS, TrainConfig, Trainer, train

__all__ = ["MODEL_PRESETS", "TrainConfig", "Trainer", "train"]
