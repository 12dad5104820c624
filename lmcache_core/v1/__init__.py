"""LMCache's ``lmcache.v1`` import paths (as the seeds use them), re-exporting this project's classes."""
