"""mmfeat: move multimodal features between processes through one shared memory pool per node."""

__version__ = "0.1.0"
