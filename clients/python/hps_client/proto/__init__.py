"""Generated protobuf and gRPC stubs (regenerate with `make proto`; do not edit by hand)."""
