"""The wire contract: schemas, codec, topic and subject names, broker clients."""
