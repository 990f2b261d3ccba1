#!/usr/bin/env bash
cd /app
mkdir src && touch src/main.py
