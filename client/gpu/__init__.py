"""The GPU: importing a CUDA VMM pool into this process, DLPack tensors over memory torch did not
allocate, and waits on a CUDA stream.

It imports nothing else of the client but the shared neutral (views made outside inference mode): the
link, the producer's and the consumer's sides import it."""
