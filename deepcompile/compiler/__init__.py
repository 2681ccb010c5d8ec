"""The torch.compile backend: aot_autograd glue, partitioner and graph bookkeeping."""
