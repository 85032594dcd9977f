"""API layer: OpenAI-compatible HTTP surface; the only place token ids become text."""
