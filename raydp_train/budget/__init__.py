"""The global privacy budget: the book, its ledger (no Ray), and the accountant actor."""
