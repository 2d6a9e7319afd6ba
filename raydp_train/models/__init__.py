"""Models: the built-in builders, the user's own, Hugging Face models, a run's released model."""
