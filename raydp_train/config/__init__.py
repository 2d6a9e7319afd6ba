"""The pipeline schema: its sections, checks, error messages and loading."""
