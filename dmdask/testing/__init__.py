"""Test helpers for dmdask: synthetic datasets (`datasets`), the contract every source
format's tests inherit (`sources.SourceTests`, needs pytest), a FUSE unmount (`mount`)."""
