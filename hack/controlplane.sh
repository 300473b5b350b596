#!/usr/bin/env bash
# Placeholder until the control-plane build lands (issue 4).
echo "[controlplane] not built yet"
