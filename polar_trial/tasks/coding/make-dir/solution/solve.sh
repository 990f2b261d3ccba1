#!/usr/bin/env bash
cd /app
mkdir build
