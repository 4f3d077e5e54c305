"""The frontend language: prompt programs that run on a radixlm backend."""
