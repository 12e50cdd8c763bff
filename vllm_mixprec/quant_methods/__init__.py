"""The `mixprec` quantization method: config, linear method and KV-cache method."""
