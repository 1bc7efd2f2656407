"""The one error the Hugging Face conversion raises for what it cannot convert."""


class UnsupportedModelError(ValueError):
    """The checkpoint or model is outside what glasslm can convert (named in the message)."""
