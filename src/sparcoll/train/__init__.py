"""`sparcoll train`: data-parallel training runs comparing sparcoll with DDP's gloo all_reduce."""
