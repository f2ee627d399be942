"""The run's data: tokenizer and dataset building, the pre-flight dataset-file checks and their cache."""
