"""Accounting: dp-accounting events and epsilon, random stopping, audit bounds (no Ray)."""
