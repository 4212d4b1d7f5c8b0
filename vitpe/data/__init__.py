"""Data: the procedural ``shapes`` dataset, real datasets behind one interface, batch-level augmentation."""
from .datasets import DataError, ImageDataset, load_dataset, resize_images
from .shapes import SHAPES_CLASSES, render_shapes, shapes_params
