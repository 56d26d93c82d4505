"""The wire format of model messages: safetensors payloads, headers and checksums; never pickle."""
