"""adapt: Day-0 bring-up of very large language models on new accelerators."""

__version__ = "0.1.0"
