"""A vLLM engine as a PrfaaS worker (see ``__main__``)."""
