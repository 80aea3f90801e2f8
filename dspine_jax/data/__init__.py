"""Prompt sources and token shards shared by training and evaluation."""
