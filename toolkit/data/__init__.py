"""Your own data: documents (jsonl, plain text, parquet) tokenized into a Megatron indexed dataset
with a manifest (`parakit data prepare`), and the manifest read back by the validator and trainer."""
