"""The ground floor's file formats: what parakit writes and reads as plain files (a prepared
dataset's manifest, a Hugging Face config.json) and the one way it publishes a file (atomically),
importable by every floor above without torch."""
