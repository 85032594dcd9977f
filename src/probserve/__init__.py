"""probserve: open language models behind the OpenAI API with complete, exact log-probabilities."""

__version__ = "0.1.0"
