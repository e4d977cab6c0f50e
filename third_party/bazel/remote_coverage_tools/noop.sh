#!/bin/sh
# No-op stand-in for Bazel's coverage tools (offline build; coverage is not collected).
exit 0
