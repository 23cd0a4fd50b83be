"""Code that exists only for the tests: a weights-only generator process, an in-process batch maker."""
