#!/bin/sh
# Installs the Node client test dependencies (the official `openai` SDK) from package-lock.json.
set -e
cd "$(dirname "$0")"
npm ci --no-audit --no-fund
