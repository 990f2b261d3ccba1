#!/usr/bin/env bash
cd /app
mv notes.md report.md
