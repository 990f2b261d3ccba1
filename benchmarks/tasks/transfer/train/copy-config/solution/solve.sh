#!/usr/bin/env bash
cd /app
cp config.ini config.bak
