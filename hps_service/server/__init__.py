"""Protocol front ends (gRPC, REST, metrics): they translate requests and errors, nothing more."""
