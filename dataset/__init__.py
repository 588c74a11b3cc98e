"""JSONL datasets and the demo-data generator."""
