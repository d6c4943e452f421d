"""flashcl inside other libraries: ``flashcl.integrations.transformers.register()`` makes flashcl an
attention implementation of Hugging Face transformers. Nothing here is imported by flashcl itself,
and each integration imports its library only when called."""
