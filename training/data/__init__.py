"""Training data (training stage): the token-shard format, the loaders, SFT records."""
