"""Datasets dlstore can generate or read without torchvision's download code: the embedded ``demo``
photo-like images and the MNIST-family IDX files."""
