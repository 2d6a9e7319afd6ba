"""Data: sources read and checked, label kinds, Parquet shards for the workers."""
